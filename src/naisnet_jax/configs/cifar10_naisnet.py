"""Section 5.2: NAIS-Net10 on CIFAR-10 (3 stages x 18 blocks, 16/32/64 filters,
each block unrolled 10 times), 450 epochs, learning rate divided by 10 at
epochs 150, 250 and 350, with 4-pixel pad-and-crop and flip augmentation."""

from naisnet_jax.configs import default


def get_config():
    config = default.get_config()
    config.dataset = "cifar10"
    config.model = "naisnet_cifar10"
    config.num_epochs = 450
    config.h = 1.0  # the paper's step and learning rate (the FC default uses 0.1 and 0.02)
    config.learning_rate = 0.1
    config.lr_boundaries_epochs = [150, 250, 350]
    config.weight_decay = 2e-4
    config.augment = True
    config.batch_size = 128
    return config
