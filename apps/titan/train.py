"""One rank of the TorchTitan app: TorchTitan's own entry point (``torchtitan.train.main``), run by
torchrun with ``--module apps.titan --config titan_debugmodel`` (see :mod:`apps.titan.run`), on
the CPU (:func:`apps.titan.compat.use_cpu`, before TorchTitan's modules load)."""

from __future__ import annotations

from apps.titan.compat import use_cpu

__all__ = ["main"]


def main() -> None:
    use_cpu()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
