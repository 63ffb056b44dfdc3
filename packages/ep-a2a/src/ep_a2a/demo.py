"""Demo of ep-a2a (`python -m ep_a2a.demo`).

The package's full demo is not written yet; this says so instead of printing anything it did not compute.
"""

import ep_a2a


def main() -> None:
    print(f"ep-a2a {ep_a2a.__version__}: the demo of this package is not implemented yet (see its README).")


if __name__ == "__main__":
    main()
