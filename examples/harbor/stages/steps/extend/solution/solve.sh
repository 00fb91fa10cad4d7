#!/bin/bash
printf '#!/bin/sh\nwc -l < /srv/tool/items.txt\n' > /srv/tool/count.sh && chmod +x /srv/tool/count.sh
