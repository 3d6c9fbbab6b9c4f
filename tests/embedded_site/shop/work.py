"""What the shop's ACCS service runs (a ``python`` service: ``fn(params, ctx)``)."""


def pack(params: dict, ctx) -> dict:
    """Return the packing slip of an order."""
    ctx.log(f"packing {params['reference']}")
    return {"slip": f"SLIP-{params['reference']}"}


def pick(params: dict, ctx) -> dict:
    """Return the items picked for an order."""
    return {"picked": params["reference"], "items": params.get("items", 1)}


def finish(params: dict, ctx) -> dict:
    """Return the closing note of a shipment."""
    return {"closed": params["reference"], "carrier": params.get("carrier", "post")}
