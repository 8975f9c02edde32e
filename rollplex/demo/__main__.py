"""`python -m rollplex.demo`: see train.py."""

from .train import main

if __name__ == "__main__":
    main()
