"""Section 5.1 at the paper's protocol: the FC NAIS-Net (one block, K = 30) and the nine
30-layer ResNet variants, SGD with momentum 0.9, learning rate 0.1, 150 epochs, 10 seeds,
on real MNIST (``mnist_pinned``; ``experiments/ablation.py --dataset`` switches to
Fashion-MNIST). ``config.model`` is set per model by the experiment.

What the paper does not state, and what we chose (the same for every model):

- ``h = 1/30`` and pixels in [0, 1] (``standardize = False``). With standardised inputs
  (784 inputs of unit variance) learning rate 0.1 with momentum 0.9 blows up the logits of
  every variant at every h we tried; with pixels in [0, 1] the shared-weight non-autonomous
  nets (NAIS-Net, ResNet-SH-NA), whose input matrix gets the gradient of all 30 steps, need
  ``h`` about ``1/K``, and ResNet-SH still blows up at ``h = 0.05``. ``h = 1/30`` is the largest
  step of a CPU check (Fashion-MNIST subset, 2 epochs, 2 seeds, ``h`` in {1, 0.5, 0.25, 0.1,
  0.05, 1/30}: ``experiments/results/ablation_h_check.md``) at which every variant trains at
  learning rate 0.1; it also makes ``K h = 1``: 30 Euler steps over unit time.
- State width 128 (``naisnet_mnist``, ``resnet*`` defaults), ``eps = 0.01`` (Algorithm 1's
  ``delta = 1 - 2 eps``), batch 128, no weight decay, no augmentation, no learning-rate decay.
"""

from naisnet_jax.configs import default

H = 1.0 / 30  # K h = 1


def get_config():
    config = default.get_config()
    config.dataset = "mnist_pinned"
    config.model = "naisnet_mnist"
    config.h = H
    config.standardize = False  # pixels in [0, 1]
    config.learning_rate = 0.1
    config.momentum = 0.9
    config.lr_boundaries_epochs = []
    config.batch_size = 128
    config.eval_batch_size = 2000
    config.num_epochs = 150
    config.num_seeds = 10
    config.checkpoint_every_epochs = 10  # an Orbax write each (~0.3 s); a resume redoes at most 10 epochs (~4 GPU s)
    config.keep_checkpoints = 2
    return config
