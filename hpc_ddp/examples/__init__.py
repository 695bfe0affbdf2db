"""Built-in example tasks: real training scripts in a few dozen lines each, for `--task gpt` and `--task cnn`."""
