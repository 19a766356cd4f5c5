// A job that dies between its two steps: it claims its key with keepRequest,
// does step one, records the checkpoint, and is killed (SIGKILL, by itself)
// before step two, so that its key stays pending under a lease nobody renews.
// Run by completer.test.mjs: node crash-job.mjs <key> <scope> <request JSON> <lease s>
import pg from 'pg';
import { idempotent } from 'pg-idempotency';

const [key, scope, requestText, lease] = process.argv.slice(2);
const pool = new pg.Pool({ max: 2 });
await idempotent(pool, { key, scope, request: JSON.parse(requestText), lease: Number(lease), keepRequest: true },
	async ({ token, checkpoint }) => {
		await checkpoint('charged', { charge: `ch-${token}` });
		process.stdout.write(`checkpointed ${token}\n`);
		process.kill(process.pid, 'SIGKILL');
		await new Promise(() => {});
	});
