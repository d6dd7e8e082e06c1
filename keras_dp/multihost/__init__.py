"""Many processes: the channel between them, their agreement, global batches."""
