// Options read at the first claim: the server's
// idempotency.max_response_size with the units PostgreSQL allows.
import { test, describe, after } from 'node:test';
import assert from 'node:assert/strict';
import pg from 'pg';
import express from 'express';
import { expressIdempotency } from 'pg-idempotency';
import { db, newKey, send, listen } from './helpers.mjs';

const pool = new pg.Pool({ max: 6 });

after(async () => {
	await pool.end();
	await db.end();
});

/* an app with no body parser: the middleware reads every byte itself */
async function bare(options) {
	const app = express();
	app.post('/x', expressIdempotency({ pool, ...options }), (req, res) => res.status(201).json({ bytes: req.rawBody.length }));
	return listen(app);
}

/*
 * What pg_settings shows for idempotency.max_response_size: a number of its
 * unit once the library is loaded in the session, the text as written
 * before.  A pool whose settings row says so, and the limit the client logs.
 */
describe('idempotency.max_response_size', () => {
	const cases = [
		['2MB', null, 2 * 1024 * 1024],
		['512 kB', null, 512 * 1024],
		['1GB', null, 1024 ** 3],
		['300000', null, 300000],
		['2048', 'kB', 2 * 1024 * 1024],
		['1048576', 'B', 1048576],
		['16', '8kB', 16 * 8 * 1024],
		['2 MB', 'B', 2 * 1024 * 1024],
		['lots', null, 1048576],
		['2XB', null, 1048576],
		['', null, 1048576],
		['-5', null, 1048576],
		['10', 'furlongs', 1048576],
	];
	for (const [setting, unit, bytes] of cases) {
		test(`setting ${JSON.stringify(setting)}, unit ${JSON.stringify(unit)}: ${bytes} bytes`, async () => {
			const shown = {
				options: pool.options,
				connect: () => pool.connect(),
				query: async (sql, params) => {
					const result = await pool.query(sql, params);
					if (/pg_settings/.test(sql))
						result.rows[0] = { ...result.rows[0], max_response_size: setting, max_response_size_unit: unit };
					return result;
				},
			};
			const logs = [];
			const app = await bare({ pool: shown, log: (message) => logs.push(message) });
			try {
				assert.equal((await send(app.url, '/x', { key: newKey() })).status, 201);
				const said = logs.find((m) => /responses over/.test(m));
				assert.match(said ?? '', new RegExp(`responses over ${bytes} bytes`), logs.join('\n'));
			} finally {
				await app.close();
			}
		});
	}
});
