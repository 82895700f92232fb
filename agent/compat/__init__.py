"""`torch.distributed` and `DistributedDataParallel` inside a worker, addressing the logical world."""
