"""`python -m keras_dp` is the `keras-dp` command."""

from keras_dp.cli import main

if __name__ == "__main__":
    main()
