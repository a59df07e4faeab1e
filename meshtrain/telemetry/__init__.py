"""What a run measures about itself: step metrics (metrics), collectives (comm_counter), and the state
bytes each rank holds (allocation)."""
