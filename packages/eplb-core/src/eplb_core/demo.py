"""Demo of eplb-core (`python -m eplb_core.demo`).

The package's full demo is not written yet; this says so instead of printing anything it did not compute.
"""

import eplb_core


def main() -> None:
    print(
        f"eplb-core {eplb_core.__version__}: the demo of this package is not implemented yet (see its README)."
    )


if __name__ == "__main__":
    main()
