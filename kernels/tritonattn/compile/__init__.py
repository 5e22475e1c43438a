"""torch.compile and SDPA: the custom ops dynamo traces (`ops`) and the SDPA flash provider (`sdpa`)."""
