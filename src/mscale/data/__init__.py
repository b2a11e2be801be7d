"""Training data: token formats on disk, the storage they are read from, sampling and preparation."""
