// Compiled (not run) by test.sh: the CommonJS types of the installed package.
import idem = require('pg-idempotency');
import pg = require('pg');

const pool = new pg.Pool();
export async function run(): Promise<number> {
	const r = await idem.idempotent(pool, { key: 'k', retryable: (e) => !(e instanceof TypeError) },
		() => 42);
	const p = idem.parseIdempotencyKey('"abc"');
	if ('key' in p)
		console.log(p.key.length);
	const d: 'succeeded' | 'failed' | 'release' = idem.defaultStorePolicy(201);
	void d;
	const c = idem.completer({ pool, scope: 'jobs', handler: async (job) => job.attempt, listenClient: { port: 5432 } });
	await c.start();
	await c.stop();
	return r.replayed ? r.value : r.value + 1;
}
