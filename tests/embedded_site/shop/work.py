"""What the shop's ACCS service runs (a ``python`` service: ``fn(params, ctx)``)."""


def pack(params: dict, ctx) -> dict:
    """Return the packing slip of an order."""
    ctx.log(f"packing {params['reference']}")
    return {"slip": f"SLIP-{params['reference']}"}


def pick(params: dict, ctx) -> dict:
    """Return the items picked for an order and its parcels, one per item."""
    items = params.get("items", 1)
    return {"picked": params["reference"], "items": items,
            "parcels": [f"{params['reference']}/{n}" for n in range(1, items + 1)]}


def finish(params: dict, ctx) -> dict:
    """Return the closing note of a shipment: its labels (one per parcel, gathered in order) and its receipt,
    from the steps before (ctx.inputs); a step that was skipped gives None."""
    labels = ctx.task_output("label") or []
    receipt = ctx.inputs.get("receipt")
    return {"closed": params["reference"], "carrier": params.get("carrier", "post"),
            "labels": [label["label"] for label in labels], "receipt": receipt["return_value"] if receipt else None}
