"""What the two processes share at run time: the batch, its transport and delivery, the weights versions,
how a batch was made, the staleness rule."""
