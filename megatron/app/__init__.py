"""The training spine: config, device backends, model, pipeline executor, train loop, checkpoints, plugins."""
