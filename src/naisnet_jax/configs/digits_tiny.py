"""A seconds-long run on scikit-learn's bundled 8x8 digits (tests, smoke runs)."""

from naisnet_jax.configs import default


def get_config():
    config = default.get_config()
    config.dataset = "digits"
    config.model_kwargs.features = 16
    config.model_kwargs.steps = 5
    config.num_epochs = 2
    config.batch_size = 64
    config.eval_batch_size = 128
    config.progress = False
    config.h = 1.0  # the values the tests were written for (the default now trains with h = 0.1)
    config.learning_rate = 0.1
    config.lr_boundaries_epochs = []
    return config
