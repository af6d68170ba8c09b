"""python -m loramux: the same as the `loramux` command."""

from .cli import main

if __name__ == "__main__":
    main()
