"""dpsgd: reproduce and extend the experiments of differentially-private SGD papers."""

__version__ = "0.1.0"
