"""`python -m codraft.cli ...` (what torchrun runs: `torchrun ... -m codraft.cli learn ...`)."""

from codraft.cli import main

if __name__ == "__main__":
    main()
