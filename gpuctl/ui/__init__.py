"""Everything gpuctl writes: through one Output (`output`), rendered as text or JSON (`render`), or drawn
(`plot`)."""
