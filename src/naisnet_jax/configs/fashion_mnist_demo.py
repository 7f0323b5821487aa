"""The main job (`make demo`): a few CPU epochs of the FC NAIS-Net on real Fashion-MNIST.

The paper's MNIST net (one block, K = 30, tanh, SGD with momentum 0.9) with a
small step, h = 0.1, and learning rate 0.02: with h = 1 the unrolled states
(and so the logits) reach tens of units and learning rate 0.1 diverges within
the first epoch; h = 0.1 keeps them O(1) and reaches ~85% test accuracy in two
epochs on two CPU cores.
"""

from naisnet_jax.configs import default


def get_config():
    config = default.get_config()
    config.h = 0.1
    config.learning_rate = 0.02
    config.num_epochs = 5
    config.lr_boundaries_epochs = [4]
    return config
