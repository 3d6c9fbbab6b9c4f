"""What the shop's ACCS service runs (a ``python`` service: ``fn(params, ctx)``)."""


def pack(params: dict, ctx) -> dict:
    """Return the packing slip of an order."""
    ctx.log(f"packing {params['reference']}")
    return {"slip": f"SLIP-{params['reference']}"}
