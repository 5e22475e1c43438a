"""The config layer: what a call computes (options), what the GPU is (hardware), and every tile and
threshold chosen per GPU (tables). It imports nothing else of the package but `errors`."""
