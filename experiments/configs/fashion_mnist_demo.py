"""The main job (`make demo`): a few CPU epochs of the FC NAIS-Net on real Fashion-MNIST."""

from experiments.configs import default


def get_config():
    config = default.get_config()
    config.num_epochs = 4
    config.lr_boundaries_epochs = [3]
    return config
