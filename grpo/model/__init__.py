"""The policy model both processes run: loading it, its log-probs (the shared-prefix forward), its FLOPs."""
