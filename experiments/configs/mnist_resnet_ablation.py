"""Section 5.1's ablation baselines on MNIST: set config.model to any of
the names in naisnet_jax.models.MODELS (resnet, resnet_sh, ..., resnet_sh_stable) or naisnet_mnist.

MNIST comes through tensorflow-datasets from a prepared data_dir (see
naisnet_jax.data.load_tfds for how to prepare it)."""

from naisnet_jax.configs import default


def get_config():
    config = default.get_config()
    config.dataset = "mnist"
    config.model = "resnet_sh"
    config.num_epochs = 150
    config.h = 1.0  # the paper's protocol: h = 1, learning rate 0.1, no decay
    config.learning_rate = 0.1
    config.lr_boundaries_epochs = []
    return config
