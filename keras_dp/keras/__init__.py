"""What touches Keras: building and compiling the model, its callbacks."""
