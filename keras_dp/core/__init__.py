"""The training core: state, compiled steps and programs, feeds, the loops."""
