"""hanzo custom ops (torch.ops.hanzo.*). Placeholder."""
