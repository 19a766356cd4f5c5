/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The background sweeper (being written: registers nothing yet).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "idempotency.h"

void
idem_worker_init(void)
{
}
