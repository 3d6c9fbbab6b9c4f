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
PICKED = {"type": "object", "required": ["picked", "items"],
          "properties": {"picked": {"type": "string"}, "items": {"type": "integer", "minimum": 0}}}
# ``label`` reads pick's output from the file ACCS_INPUTS names: {"pick": {"picked": ..., "items": ...}}.
LABEL = ("import json, os, sys; inputs = json.load(open(os.environ['ACCS_INPUTS'])); "
         "print(json.dumps(dict(label=sys.argv[1], items=inputs['pick']['items'])))")

pick = code.service("shop-pick", executor="python", executor_config={"callable": "shop.work:pick"},
                    params_schema=ORDER, max_attempts=2)
label = code.service("shop-label", executor="command", params_schema=ORDER, timeout_seconds=30,
                     executor_config={"argv": ["python3", "-c", LABEL, "{reference}"]})
finish = code.service("shop-finish", executor="python", executor_config={"callable": "shop.work:finish"},
                      params_schema=ORDER)

code.workflow("ship-order", description="Pick, label, receipt (for an order with items) and close an order.", steps=[
    code.step("pick", pick, default_params={"items": 2}, output_schema=PICKED),
    code.step("label", label, depends_on=["pick"]),
    # A branch: an empty order gets no receipt (the task ends skipped, the reason on the timeline).
    code.step("receipt", receipt, depends_on=["pick"], default_params={"reference": "from-code"},
              when="$.pick.items > 0"),
    # always: ship closes the order once label and receipt are final, a skipped receipt included.
    code.step("ship", finish, depends_on=["label", "receipt"], always=True,
              default_params={"carrier": os.environ.get("SHOP_PIPELINE_CARRIER", "post")}),
])
