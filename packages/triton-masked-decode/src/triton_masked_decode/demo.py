"""Demo of triton-masked-decode (`python -m triton_masked_decode.demo`).

The package's full demo is not written yet; this says so instead of printing anything it did not compute.
"""

import triton_masked_decode


def main() -> None:
    print(
        f"triton-masked-decode {triton_masked_decode.__version__}: the demo of this package is not implemented yet (see its README)."
    )


if __name__ == "__main__":
    main()
