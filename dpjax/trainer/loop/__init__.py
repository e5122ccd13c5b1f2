"""A run of a resolved plan: what it computes (`build`), the loop (`training_loop`, given its
collaborators by `loop_parts`), evaluation, stops, metrics, and what it states at its start and
end (`run_report`). Nothing here reads a config."""
