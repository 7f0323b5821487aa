"""Section 5.1 at the paper's protocol: the FC NAIS-Net (one block, K = 30) and the nine
30-layer ResNet variants, SGD with momentum 0.9, learning rate 0.1, 150 epochs, 10 seeds,
on real MNIST (``mnist_pinned``; ``experiments/ablation.py --dataset`` switches to
Fashion-MNIST). ``config.model`` is set per model by the experiment.

What the paper does not state, and what we chose:

- The step size: ``h = 1/30`` by default (``K h = 1``); ``experiments/ablation.py --hs`` runs the
  whole comparison at ``h`` in {1, 0.5, 0.25, 0.1, 1/30} (the paper's ResNet takes full steps), and
  ``experiments/fc_spectrum.py`` shows what Algorithm 1 does to ``R`` at each (RESULTS.md, 5.1).
- Inputs standardised by the training set's mean and std (the default config's ``standardize``).
- State width 128 (``naisnet_mnist``, ``resnet*`` defaults), ``eps = 0.01`` (Algorithm 1's
  ``delta = 1 - 2 eps``), batch 128, no weight decay, no augmentation, no learning-rate decay.
"""

from naisnet_jax.configs import default

H = 1.0 / 30.0


def get_config():
    config = default.get_config()
    config.dataset = "mnist_pinned"
    config.model = "naisnet_mnist"
    config.h = H
    config.learning_rate = 0.1
    config.momentum = 0.9
    config.lr_boundaries_epochs = []
    config.batch_size = 128
    config.eval_batch_size = 2000
    config.num_epochs = 150
    config.num_seeds = 10
    config.checkpoint_every_epochs = 10  # a sweep checkpoint costs an Orbax write; resume loses <= 10 epochs
    config.keep_checkpoints = 2
    return config
