#!/bin/bash
printf '#!/bin/sh\necho 0\n' > /srv/tool/count.sh && chmod +x /srv/tool/count.sh
