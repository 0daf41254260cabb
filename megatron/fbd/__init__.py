"""MegaFBD: forward-backward disaggregation. Each logical rank runs as a forward instance and a
backward instance on different physical ranks (`--forward-backward-disaggregating`)."""
