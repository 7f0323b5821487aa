"""NAIS-Net (conv, section 5.2) in PyTorch, for the side-by-side training-step benchmark.

The same network and the same step as ``naisnet_jax.models.NaisNetConv`` with
``train.train_step``: stem conv (no bias) -> BatchNorm -> ReLU; stages of NAIS conv
blocks ``X_{k+1} = X_k + h relu(conv(X_k, C) + conv(U, D) + E)``, ``X_0 = 0``, whose
state kernel has centre taps ``-1`` (``delta = 0``); the first block of a later
stage has a stride-2 input convolution and BatchNorm on its drive (no bias); global
average pooling; a linear classifier; cross-entropy; SGD with momentum and weight
decay; then Algorithm 2 on every state kernel. Layout NCHW tensors in channels-last
memory (cuDNN's fast layout). The one difference: PyTorch pads a stride-2 3x3
convolution by one pixel on each side, XLA's SAME by one pixel at the end only (same
shapes and cost, inputs shifted by a pixel). ``first_step=True`` starts each block at
``X_1 = h relu(drive)`` (exactly the first step from ``X_0 = 0``) and runs the other ``K - 1``
steps, as ``naisnet_jax``'s tied fast paths do: the same network with one state convolution
fewer per block.
"""

from __future__ import annotations

import torch
import torch.nn as tnn
import torch.nn.functional as F


def centre_mask(channels: int, k: int, device=None) -> torch.Tensor:
    """OIHW mask of the taps ``[c, c, p, p]``."""
    mask = torch.zeros(channels, channels, k, k, device=device)
    p = k // 2
    idx = torch.arange(channels, device=device)
    mask[idx, idx, p, p] = 1.0
    return mask


class NaisConvBlock(tnn.Module):
    def __init__(
        self,
        c_in: int,
        c: int,
        *,
        steps: int,
        stride: int,
        normalize_drive: bool,
        h: float = 1.0,
        k: int = 3,
        first_step: bool = False,
    ):
        super().__init__()
        self.steps, self.h, self.first_step = steps, h, first_step
        self.input = tnn.Conv2d(c_in, c, k, stride=stride, padding=k // 2, bias=not normalize_drive)
        self.drive_norm = tnn.BatchNorm2d(c, momentum=0.1, eps=1e-5) if normalize_drive else None
        self.state_kernel = tnn.Parameter(torch.randn(c, c, k, k) / (k * k * c) ** 0.5)
        self.register_buffer("mask", centre_mask(c, k))

    def kernel(self) -> torch.Tensor:
        """The state kernel with centre taps ``-1`` (``delta = 0``)."""
        return self.state_kernel * (1 - self.mask) - self.mask

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        drive = self.input(u)
        if self.drive_norm is not None:
            drive = self.drive_norm(drive)
        kernel = self.kernel()
        pad = kernel.shape[-1] // 2
        if self.first_step:  # x_1 = h relu(drive) from X_0 = 0, then K - 1 steps (as naisnet_jax's fast paths)
            x, steps = self.h * F.relu(drive), self.steps - 1
        else:
            x, steps = torch.zeros_like(drive), self.steps
        for _ in range(steps):
            x = x + self.h * F.relu(F.conv2d(x, kernel, padding=pad) + drive)
        return x


class NaisNetConv(tnn.Module):
    def __init__(
        self,
        *,
        num_classes=10,
        stage_sizes=(18, 18, 18),
        filters=(16, 32, 64),
        steps=10,
        in_channels=3,
        first_step=False,
    ):
        super().__init__()
        self.stem = tnn.Conv2d(in_channels, filters[0], 3, padding=1, bias=False)
        self.stem_bn = tnn.BatchNorm2d(filters[0], momentum=0.1, eps=1e-5)
        blocks, c_in = [], filters[0]
        for i, (size, width) in enumerate(zip(stage_sizes, filters)):
            for j in range(size):
                change = i > 0 and j == 0
                blocks.append(
                    NaisConvBlock(
                        c_in,
                        width,
                        steps=steps,
                        stride=2 if change else 1,
                        normalize_drive=True,  # every drive, as naisnet_cifar10 by default (drive_norm="every")
                        first_step=first_step,
                    )
                )
                c_in = width
        self.blocks = tnn.ModuleList(blocks)
        self.classifier = tnn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.classifier(x.float().mean(dim=(2, 3)))


@torch.no_grad()
def project_state_kernels(model: NaisNetConv, eps: float = 0.01) -> None:
    """Algorithm 2 with ``delta = 0``: centre taps ``-1``; per output channel, the
    absolute sum of the other taps feeding it is scaled down to ``1 - eps``."""
    for block in model.blocks:
        w, mask = block.state_kernel, block.mask
        others = w * (1 - mask)
        radius = others.abs().sum(dim=(1, 2, 3))
        budget = 1.0 - eps
        scale = torch.where(radius > budget, budget / radius.clamp_min(1e-30), torch.ones_like(radius))
        w.copy_(others * scale[:, None, None, None] - mask)
