"""The shop's pipeline defined in code (ACCS's workflows as code), stored by ``manage.py accs_sync``.

``SHOP_PIPELINE_CARRIER`` stands in for an edit of this file between two deploys: another carrier is
another definition of the ``ship`` step, so the next ``accs_sync`` stores version 2.
"""

import os

from shop.tasks import receipt
from workflows import code

ORDER = {"type": "object", "properties": {"reference": {"type": "string"}, "items": {"type": "integer"},
                                          "carrier": {"type": "string"}}}

# What ``pick`` returns, checked when it succeeds (an output that breaks it fails the attempt).
PICKED = {"type": "object", "required": ["picked", "items", "parcels"],
          "properties": {"picked": {"type": "string"}, "items": {"type": "integer", "minimum": 0},
                         "parcels": {"type": "array", "items": {"type": "string"}}}}
# ``label`` runs once per parcel: argv names its parcel ({inputs.item}), and the file ACCS_INPUTS names
# holds pick's output, the parcel and its place: {"pick": {...}, "item": "R-1/2", "index": 1}.
LABEL = ("import json, os, sys; inputs = json.load(open(os.environ['ACCS_INPUTS'])); "
         "print(json.dumps(dict(label=sys.argv[1], n=inputs['index'] + 1, of=len(inputs['pick']['parcels']))))")

pick = code.service("shop-pick", executor="python", executor_config={"callable": "shop.work:pick"},
                    params_schema=ORDER, max_attempts=2)
label = code.service("shop-label", executor="command", params_schema=ORDER, timeout_seconds=30,
                     executor_config={"argv": ["python3", "-c", LABEL, "{inputs.item}"]})
finish = code.service("shop-finish", executor="python", executor_config={"callable": "shop.work:finish"},
                      params_schema=ORDER)

code.workflow("ship-order", description="Pick, label each parcel, receipt (for an order with items) and close.", steps=[
    code.step("pick", pick, default_params={"items": 2}, output_schema=PICKED),
    # A fan-out: one label task per parcel pick returned (none for an empty order: the step is skipped).
    code.step("label", label, depends_on=["pick"], fan_out={"over": "$.pick.parcels"}),
    # A branch: an empty order gets no receipt (the task ends skipped, the reason on the timeline).
    code.step("receipt", receipt, depends_on=["pick"], default_params={"reference": "from-code"},
              when="$.pick.items > 0"),
    # always: ship closes the order once label and receipt are final (skipped ones included), gathering the
    # labels in parcel order.
    code.step("ship", finish, depends_on=["label", "receipt"], always=True,
              default_params={"carrier": os.environ.get("SHOP_PIPELINE_CARRIER", "post")}),
])
