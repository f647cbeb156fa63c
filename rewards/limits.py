"""The largest reward a sample may have (the trainer checks advantages against it without importing the
reward functions themselves)."""

# rewards travel and are normalised in float32: past this, a group's sums and squares overflow (3e38 would
# give NaN advantages); no reward of any use comes near it
REWARD_LIMIT = 1e15
