"""Models. Placeholder."""
def load(*a, **k):
    raise NotImplementedError
