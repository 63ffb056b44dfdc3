"""Demo of sparse-mla-attn (`python -m sparse_mla_attn.demo`).

The package's full demo is not written yet; this says so instead of printing anything it did not compute.
"""

import sparse_mla_attn


def main() -> None:
    print(
        f"sparse-mla-attn {sparse_mla_attn.__version__}: the demo of this package is not implemented yet (see its README)."
    )


if __name__ == "__main__":
    main()
