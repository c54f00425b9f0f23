"""The Hydra configs of lra (a package so that an installed copy finds them)."""
