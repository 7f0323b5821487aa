"""Section 5.2 on CIFAR at the paper's schedule: 450 epochs, learning rate 0.1 divided by 10 at
epochs 150, 250 and 350, SGD with momentum 0.9, batch 128, 4-pixel pad-and-crop and flip
augmentation, weight decay 2e-4, 5 runs (the paper averages 5).

``get_config("cifar100,naisnet_cifar1")`` (or ``--config=cifar_paper:cifar100,naisnet_cifar1``)
picks the dataset (``cifar10`` | ``cifar100``, TFDS, prepared offline under ``config.data_dir``)
and the model (``naisnet_cifar1`` | ``naisnet_cifar10`` | ``resnet_cifar``); the default is
CIFAR-10 with NAIS-Net10. Train all seeds at once with ``naisnet_jax.sweep.train_sweep``.
"""

from naisnet_jax.configs import default

DATASETS = ("cifar10", "cifar100")
MODELS = ("naisnet_cifar1", "naisnet_cifar10", "resnet_cifar")


def get_config(arg: str | None = None):
    parts = (arg or "cifar10,naisnet_cifar10").split(",")
    dataset, model = parts if len(parts) == 2 else (None, None)
    if dataset not in DATASETS or model not in MODELS:
        raise ValueError(
            f"cifar_paper config argument {arg!r}: expected 'DATASET,MODEL' with DATASET in "
            f"{DATASETS} and MODEL in {MODELS}."
        )
    config = default.get_config()
    config.dataset = dataset
    config.model = model
    config.num_epochs = 450
    config.lr_boundaries_epochs = [150, 250, 350]
    config.h = 1.0  # the paper's conv blocks: a full step (the FC default config uses 0.1)
    config.learning_rate = 0.1
    config.momentum = 0.9
    config.weight_decay = 2e-4
    config.augment = True
    config.batch_size = 128
    config.num_seeds = 5
    return config
