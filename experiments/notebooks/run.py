"""Execute a notebook top to bottom with nbclient and write the executed copy elsewhere.

    python -m experiments.notebooks.run [--quick] [--out=runs/quickstart.ipynb] [--cwd=.] [NOTEBOOK]

``make notebook`` runs the quickstart this way. The kernel is an IPython kernel of this
interpreter (ipykernel's own kernel spec, whatever other kernels are installed), started in
``--cwd`` (default: the repository root, so the quickstart's work directory is
``runs/quickstart``) with the repository on ``PYTHONPATH``. ``--quick`` sets
``NAISNET_NOTEBOOK_QUICK=1``. The committed notebook is never written to: it carries no outputs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
QUICKSTART = pathlib.Path(__file__).resolve().parent / "quickstart.ipynb"


def execute(nb, *, cwd, quick: bool = False, timeout: int = 600) -> None:
    """Runs every code cell of ``nb`` (an ``nbformat`` notebook, filled in place) in a fresh
    kernel started in ``cwd``. A failing cell raises ``nbclient.exceptions.CellExecutionError``;
    ``nb`` then holds the outputs up to that cell. The kernel is shut down in every case."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    env = dict(
        os.environ,
        NAISNET_NOTEBOOK_QUICK="1" if quick else "0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    # kernel_dirs=[]: only ipykernel's own spec, whose command is this interpreter
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute(env=env)
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def main(argv=None) -> int:
    import nbformat
    from nbclient.exceptions import CellExecutionError

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", nargs="?", default=str(QUICKSTART))
    parser.add_argument("--out", default="runs/quickstart.ipynb", help="where the executed copy goes")
    parser.add_argument("--cwd", default=str(REPO), help="the kernel's working directory")
    parser.add_argument("--quick", action="store_true", help="NAISNET_NOTEBOOK_QUICK=1: a small, fast run")
    args = parser.parse_args(argv)
    source, out = pathlib.Path(args.notebook).resolve(), pathlib.Path(args.out).resolve()
    if out == source:
        raise ValueError(
            f"--out={args.out!r} is the notebook itself; committed notebooks carry no outputs, "
            f"write the executed copy elsewhere (e.g. runs/)."
        )
    nb = nbformat.read(source, as_version=4)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        execute(nb, cwd=args.cwd, quick=args.quick)
    except CellExecutionError as error:
        print(error, file=sys.stderr)
        print(f"failed; the executed part is in {out}", file=sys.stderr)
        return 1
    finally:
        nbformat.write(nb, out)
    print(f"executed {source.name} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
