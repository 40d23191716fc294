"""milepost.training: a Checkpointer for a sequence of training steps."""
