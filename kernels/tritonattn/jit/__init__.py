"""The @triton.jit kernels and their shared helpers (`common`); the Gluon Hopper forward (`sm90`) is
imported only where it runs. This layer imports only the config layer."""
