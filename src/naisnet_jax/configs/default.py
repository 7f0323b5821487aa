"""Default config: the paper's FC NAIS-Net (one block, K = 30) on Fashion-MNIST.

It trains: 20 epochs of SGD with momentum 0.9 at learning rate 0.02, divided by 10 at
epochs 10 and 15, with step size h = 0.1, end at test accuracy 0.891 (train loss 0.148;
seed 0, real Fashion-MNIST, about 2 s an epoch on two CPU cores). With h = 1 the unrolled states
grow to tens of units (each step adds up to h to every unit, K = 30 steps), so do the
logits, and SGD at the paper's learning rate 0.1 ends at train loss in the hundreds; h = 0.1
keeps the states and logits O(1). On ``dataset="digits"`` the same config reaches about
0.96 test accuracy in a few seconds.

Every other config (``experiments/configs/*.py``) imports this one with
``from naisnet_jax.configs import default`` and overrides only what differs, so configs
load from any directory once the package is installed.
"""

import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    # model
    config.model = "naisnet_mnist"
    config.model_kwargs = ml_collections.ConfigDict()  # extra keyword arguments of the model
    config.eps = 0.01  # A = -R^T R - eps I; Algorithm 1's delta = 1 - 2 eps
    config.eta = 0.5  # Algorithm 2: |delta_c| <= 1 - eta (only with learnable delta)
    config.relaxed = False  # Algorithm 1 with delta = 2 (1 - eps)
    config.h = 0.1  # step size, (0, 1]; h * K = 3 bounds how far a state moves
    config.adaptive_tol = ml_collections.FieldReference(
        None, field_type=float
    )  # stop each pattern when ||x_k - x_{k-1}|| < tol
    config.max_steps = 100  # bound on the adaptive unroll
    # "auto": on a GPU a NAIS net gets block_vjp="fused", scan_unroll=10 unless model_kwargs sets
    # its own speed options (same maths); "plain": the modules' defaults (naisnet_jax.models.model_spec)
    config.fast_path = "auto"
    # data
    config.dataset = "fashion_mnist_idx"
    config.data_dir = ml_collections.FieldReference(
        None, field_type=str
    )  # dataset-specific default (see naisnet_jax.data.load_dataset)
    config.limit_train = ml_collections.FieldReference(None, field_type=int)
    config.limit_test = ml_collections.FieldReference(None, field_type=int)
    # hold out the last n training examples as the evaluation split, in place of the test set
    config.validation = ml_collections.FieldReference(None, field_type=int)
    config.augment = False
    config.augment_flip = True  # with augment: also mirror left-right (False: pad and crop only)
    # optimisation (SGD with momentum 0.9, as the paper; its learning rate 0.1 diverges here)
    config.learning_rate = 0.02
    config.momentum = 0.9
    config.weight_decay = 0.0
    config.lr_boundaries_epochs = [10, 15]  # divide the learning rate by 10 at these epochs
    config.lr_decay_factor = 0.1
    config.batch_size = 128
    config.eval_batch_size = 1000
    config.num_epochs = 20
    config.seed = 0
    config.num_seeds = 1  # naisnet_jax.sweep trains seeds seed, seed + 1, ..., side by side
    config.standardize = (
        True  # data: inputs (x/255 - mean) / std with the training set's channel statistics; False: x/255
    )
    # bookkeeping
    config.checkpoint_every_epochs = 1
    config.keep_checkpoints = 3
    config.steps_per_chunk = 50  # train steps per jitted scan (progress bar granularity)
    config.progress = True
    # devices: batches are split over this many (None: all); see train.make_mesh
    config.num_devices = ml_collections.FieldReference(None, field_type=int)
    # with several devices: BatchNorm by the whole batch (True: one device's numbers) or by each
    # device's rows (False: no all-reduce per BatchNorm layer; see train.train_step)
    config.sync_batch_norm = True
    return config
