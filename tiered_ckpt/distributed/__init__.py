"""torch.distributed integration. Everything here is a no-op without an initialized process group."""
