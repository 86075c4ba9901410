"""Float64 / numpy references that only tests and scripts import."""
