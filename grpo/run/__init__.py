"""A run around the two processes: its folder at start, its outputs, ports, trackers, progress."""
