
# Copyright: the idempotency extension authors.
#
# 210_upgrade_1_5.pl: ALTER EXTENSION idempotency UPDATE TO '1.5', from each
# released version (1.0, 1.1, 1.2, 1.3, 1.4), on a server without Citus.
#
# What it proves, for each of them:
#   - a database with finished keys (with response bodies), a pending key
#     under a live lease, a bound tenant's pending key and scope bindings
#     updates without touching a stored row of idempotency.keys (same ctid
#     and xmin, every column identical), a row of scope_bindings (same
#     ctid, xmin and columns) or the token sequence;
#   - after the update the finished keys replay their stored responses, the
#     owners of the pending keys finish them with the tokens they got
#     before the update, and a role bound before the update is still
#     confined to its prefix (42501 for another scope, nothing changes);
#   - unbind_scope, now PL/pgSQL, keeps its owner and the privileges an
#     administrator set on it (EXECUTE granted to a role, PUBLIC still
#     without); that role unbinds with it (true, then false, and the
#     unbound tenant is free); bind_scope and unbind_scope work for a new
#     binding (true, then false);
#   - idempotency.distribute() raises 55000 without Citus (also with a
#     shard count it would refuse on Citus) and changes nothing; PUBLIC may
#     not execute it, and a role with USAGE on the schema gets 42501;
#   - cluster_stats answers exactly one row, node 'local', whose columns
#     are this database's stats row, for a superuser and for a plain role;
#   - the updated catalog is a fresh 1.5 install's: with the
#     administrator's privileges, every definition (functions with their
#     signature, language, volatility and settings, views, claim_result,
#     types, indexes, constraints, triggers, the sequence, the member list,
#     the configuration tables, the initial privileges); without them,
#     everything catalog_queries compares, owners and privileges included,
#     and the views' definitions.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).  Port
# 55476 only names the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# No sweeps: no key's sweep_at moves while the test compares rows.
my $node = new_node('upgrade_1_5', port => 55476,
	init => [ extra => [ '--encoding=UTF8', '--locale=C' ] ],
	conf => ['idempotency.sweep_interval = 0']);

sub sql { my ($db, $sql) = @_; return $node->safe_psql($db, $sql); }

my @from = ('1.0', '1.1', '1.2', '1.3', '1.4');

my $unbind_sig     = 'idempotency.unbind_scope(regrole)';
my $distribute_sig = 'idempotency.distribute(integer)';

# regress_tenant: bound to the prefix 'tenant:'; regress_binder: the
# administrator's role for unbinding; regress_plain: USAGE on the schema
# and nothing else.
my $roles = 'regress_tenant, regress_binder, regress_plain';
sql('postgres', 'CREATE ROLE regress_tenant; CREATE ROLE regress_binder; CREATE ROLE regress_plain');

sub ext_version
{
	my ($db) = @_;
	return sql($db, "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'");
}

# Every row of scope_bindings: where the tuple is, who wrote it, its columns.
my $binding_rows_sql =
    "SELECT string_agg(concat_ws('|', ctid, xmin, role, scope_prefix), E'\\n' "
  . "ORDER BY role::text) FROM idempotency.scope_bindings";
my $seq_sql = 'SELECT last_value FROM idempotency.token_seq';

# "owner acl" of unbind_scope.
my $unbind_acl_sql =
  "SELECT concat_ws(' ', proowner::regrole, proacl) FROM pg_proc WHERE oid = '$unbind_sig'::regprocedure";

# Who may execute unbind_scope and distribute: "function:role=bool,...".
my $may_execute_sql =
    "SELECT string_agg(f || ':' || r || '=' || has_function_privilege(r, s, 'EXECUTE'), ',' "
  . "ORDER BY f, r) FROM (VALUES ('unbind', '$unbind_sig'), ('distribute', '$distribute_sig')) "
  . "AS fn(f, s), unnest(ARRAY['public', 'regress_tenant', 'regress_binder', 'regress_plain']) AS r";

# cluster_stats: "how many rows|their nodes|whether each row, without its
# node, is this database's stats row|whether the counters counted", read
# in one statement.
my $cluster_stats_sql =
    "SELECT concat_ws('|', count(*), string_agg(c.node, ','), "
  . "bool_and(to_jsonb(c) - 'node' = (SELECT to_jsonb(s) FROM idempotency.stats s "
  . "WHERE s.database = current_database())), bool_and(c.claims > 0 AND c.finishes > 0)) "
  . "FROM idempotency.cluster_stats c";

# The definitions of the extension's functions, without owner or privileges.
my $function_defs_sql =
    "SELECT string_agg(pg_get_functiondef(p.oid), E'\\n' ORDER BY p.oid::regprocedure::text) "
  . "FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid "
  . "WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e' "
  . "AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency')";
# The definitions of the extension's views, each under its name.
my $view_defs_sql =
    "SELECT string_agg(c.oid::regclass || E':\\n' || pg_get_viewdef(c.oid), E'\\n' "
  . "ORDER BY c.oid::regclass::text) FROM pg_class c "
  . "WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'v'";

my $done_body   = q{'{"id": 1, "items": ["a", "b"]}'};
my $failed_body = q{'{"error": "card declined"}'};
my %md5;
$md5{done}   = body_md5($node, 'postgres', $done_body);
$md5{failed} = body_md5($node, 'postgres', $failed_body);

# =========================================================================
# A fresh 1.5 install, to compare with
# =========================================================================
sql('postgres', 'CREATE DATABASE fresh');
sql('fresh', "CREATE EXTENSION idempotency VERSION '1.5'");
is(ext_version('fresh'), '1.5', 'fresh: 1.5 is installed');
is( sql('fresh',
		    "SELECT starts_with(idempotency.idem_version(), default_version || '.') "
		  . "FROM pg_available_extensions WHERE name = 'idempotency'"),
	't', 'fresh: the loaded library is the newest version, which serves 1.5');
my %catalog = catalog_queries();
my %fresh;
$fresh{$_} = sql('fresh', $catalog{$_}) foreach keys %catalog;
$fresh{'function definitions'} = sql('fresh', $function_defs_sql);
$fresh{'view definitions'}     = sql('fresh', $view_defs_sql);
isnt($fresh{$_}, '', "fresh: $_: the query finds something") foreach sort keys %fresh;
like($fresh{'function definitions'},
	qr/FUNCTION idempotency\.distribute\(shard_count integer DEFAULT NULL::integer\)\n RETURNS void\n LANGUAGE plpgsql\n SET search_path TO 'pg_catalog', 'pg_temp'\n/,
	'fresh: distribute(shard_count integer DEFAULT NULL) is PL/pgSQL, VOLATILE, with its search_path');
like($fresh{'function definitions'},
	qr/FUNCTION idempotency\.unbind_scope\(role regrole\)\n RETURNS boolean\n LANGUAGE plpgsql\n STRICT\n SET search_path TO 'pg_catalog', 'pg_temp'\n/,
	'fresh: unbind_scope(role regrole) is PL/pgSQL, STRICT, with its search_path');
like($fresh{'view definitions'}, qr/^idempotency\.cluster_stats:\n.*cluster_stats_rows\(\)/s,
	'fresh: cluster_stats reads cluster_stats_rows()');
like($fresh{'functions (definition, owner, privileges)'},
	qr/FUNCTION idempotency\.distribute\(.*?owner postgres, acl \{postgres=X\/postgres\}/s,
	'fresh: only its owner may execute distribute()');
like($fresh{'relations (columns, options, owner, privileges)'},
	qr/^idempotency\.cluster_stats v p postgres \{postgres=arwdDxtm?\/postgres,=r\/postgres\} 1 node text/m,
	'fresh: PUBLIC may read cluster_stats, whose first column is node');

# =========================================================================
# Each released version: fill, bind, grant, update, check
# =========================================================================
foreach my $from (@from)
{
	(my $db = "up_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	is(ext_version($db), $from, "$db: $from is installed");
	sql($db, "GRANT USAGE ON SCHEMA idempotency TO $roles");

	# --- keys and bindings, under the old version and the 1.5 library ------
	my %tok;
	foreach my $key (qw(done failed live))
	{
		my $c = claim($node, $db, qq{'$key', request => '{"k": "$key"}', lease => '1 hour'});
		is($c->{outcome} . ',' . $c->{attempt}, 'claimed,1', "$db: $key is claimed under $from");
		$tok{$key} = $c->{token};
	}
	sql($db, "SELECT idempotency.idem_finish('done', $tok{done}, 201, $done_body)");
	sql($db, "SELECT idempotency.idem_finish('failed', $tok{failed}, 402, $failed_body, "
		  . "status => 'failed')");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "$db: done replays under $from");

	sql($db, "SELECT idempotency.bind_scope('regress_tenant', 'tenant:'); "
		  . "SELECT idempotency.bind_scope('regress_plain', 'plain:')");
	my $c = claim($node, $db, q{'t1', request => '{"t": 1}', scope => 'tenant:orders', lease => '1 hour'},
		role => 'regress_tenant');
	is($c->{outcome}, 'claimed', "$db: the bound tenant claims in its prefix under $from");
	$tok{t1} = $c->{token};
	is( sqlstate_of($node, $db,
			"SET ROLE regress_tenant; SELECT * FROM idempotency.idem_claim('t2', scope => 'other')"),
		'42501', "$db: and is refused another scope under $from");

	# The administrator lets regress_binder unbind roles: EXECUTE on
	# unbind_scope, and the rights its DELETE needs (it runs as its caller).
	sql($db, qq{
GRANT EXECUTE ON FUNCTION $unbind_sig TO regress_binder;
GRANT SELECT, DELETE ON idempotency.scope_bindings TO regress_binder;
});
	my $unbind_acl = sql($db, $unbind_acl_sql);
	like($unbind_acl, qr/^postgres \{postgres=X\/postgres,regress_binder=X\/postgres\}$/,
		"$db: the administrator granted EXECUTE on unbind_scope to regress_binder");
	my $bindings_acl =
	  sql($db, "SELECT relacl FROM pg_class WHERE oid = 'idempotency.scope_bindings'::regclass");
	my $may_unbind = sql($db,
		    "SELECT string_agg(r || '=' || has_function_privilege(r, '$unbind_sig', 'EXECUTE'), ',' "
		  . "ORDER BY r) FROM unnest(ARRAY['public', 'regress_tenant', 'regress_binder', "
		  . "'regress_plain']) AS r");
	is($may_unbind,
		'public=false,regress_binder=true,regress_plain=false,regress_tenant=false',
		"$db: only regress_binder may execute unbind_scope");

	my $rows     = key_rows($node, $db);
	my $bindings = sql($db, $binding_rows_sql);
	my $seq      = sql($db, $seq_sql);
	like($bindings, qr/\|regress_plain\|plain:\n.*\|regress_tenant\|tenant:$/,
		"$db: two bindings before the update");

	# --- the update --------------------------------------------------------
	is(sqlstate_of($node, $db, "ALTER EXTENSION idempotency UPDATE TO '1.5'"), '00000',
		"$db: ALTER EXTENSION idempotency UPDATE TO '1.5' succeeds");
	is(ext_version($db), '1.5', "$db: updated to 1.5");
	is(key_rows($node, $db), $rows,
		"$db: every stored key is the same tuple (ctid, xmin), column for column");
	is(sql($db, $binding_rows_sql), $bindings,
		"$db: every binding is the same tuple (ctid, xmin), column for column");
	is(sql($db, $seq_sql), $seq, "$db: the token sequence did not move");

	# --- unbind_scope's owner and privileges ---------------------------------
	is(sql($db, $unbind_acl_sql), $unbind_acl,
		"$db: unbind_scope keeps its owner and the administrator's grant");
	is( sql($db, "SELECT relacl FROM pg_class WHERE oid = 'idempotency.scope_bindings'::regclass"),
		$bindings_acl, "$db: scope_bindings keeps its privileges");
	is( sql($db, $may_execute_sql),
		    'distribute:public=false,distribute:regress_binder=false,'
		  . 'distribute:regress_plain=false,distribute:regress_tenant=false,'
		  . 'unbind:public=false,unbind:regress_binder=true,unbind:regress_plain=false,'
		  . 'unbind:regress_tenant=false',
		"$db: regress_binder alone may execute unbind_scope, nobody distribute");
	is(stale_initacl_deps($node, $db), '',
		"$db: no role dependency of initial privileges outlives them");

	# --- the old keys ------------------------------------------------------
	is_deeply(claim($node, $db, q{'done', request => '{"k": "done"}'}),
		replay_row('succeeded', 201, $md5{done}), "$db: done replays its stored response");
	is_deeply(claim($node, $db, q{'failed', request => '{"k": "failed"}'}),
		replay_row('failed', 402, $md5{failed}), "$db: failed replays its stored failure");
	is_deeply(claim($node, $db, q{'done', request => '{"k": "other"}'}), mismatch_row(),
		"$db: done with another request is a mismatch");
	$c = claim($node, $db, q{'live', request => '{"k": "live"}'});
	is($c->{outcome} . ',' . ($c->{token} // 'NULL'), 'in_progress,NULL',
		"$db: live is in progress under its old lease");
	is( sqlstate_of($node, $db,
			"SELECT idempotency.idem_finish('live', $tok{live}, 200, '{\"done\": true}')"),
		'00000', "$db: the owner of live finishes it with its old token");
	is( sql($db, "SELECT concat_ws(',', status, attempt, token, response_code) "
			  . "FROM idempotency.keys WHERE scope = '' AND key = 'live'"),
		"succeeded,1,$tok{live},200", "$db: live succeeded at attempt 1 with that token");

	# --- the bound tenant is still confined ----------------------------------
	$rows = key_rows($node, $db);
	$seq  = sql($db, $seq_sql);
	my @refused = (
		'a claim in another scope' =>
		  "SELECT * FROM idempotency.idem_claim('t2', scope => 'other')",
		'a claim in the default scope' => "SELECT * FROM idempotency.idem_claim('t2')",
		'a lookup in the default scope' => "SELECT * FROM idempotency.idem_lookup('done')",
		'a finish of its key under another scope' =>
		  "SELECT idempotency.idem_finish('t1', $tok{t1}, 200, NULL, 'other')");
	while (my ($what, $call) = splice(@refused, 0, 2))
	{
		is(sqlstate_of($node, $db, "SET ROLE regress_tenant; $call"), '42501',
			"$db: the tenant bound before the update is refused $what (42501)");
	}
	is(key_rows($node, $db), $rows, "$db: the refused calls changed no key");
	is(sql($db, $seq_sql), $seq, "$db: and drew no token");
	is( sql($db,
			    "SET ROLE regress_tenant; SELECT idempotency.idem_finish('t1', $tok{t1}, 201, "
			  . "'{\"t\": 1}', 'tenant:orders') IS NOT NULL"),
		't', "$db: the tenant finishes its pending key with its old token");
	is_deeply(
		claim($node, $db, q{'t1', request => '{"t": 1}', scope => 'tenant:orders'},
			role => 'regress_tenant'),
		replay_row('succeeded', 201, body_md5($node, $db, q{'{"t": 1}'})),
		"$db: and gets its replay");

	# --- bind_scope and unbind_scope -----------------------------------------
	sql($db, "SELECT idempotency.bind_scope('regress_binder', 'binder:')");
	is( sql($db, "SELECT scope_prefix FROM idempotency.scope_bindings "
			  . "WHERE role = 'regress_binder'::regrole"),
		'binder:', "$db: bind_scope binds a role after the update");
	is( sqlstate_of($node, $db,
			"SET ROLE regress_binder; SELECT * FROM idempotency.idem_claim('b', scope => 'other')"),
		'42501', "$db: which is then confined");
	is(sql($db, "SELECT idempotency.unbind_scope('regress_binder')"), 't',
		"$db: unbind_scope deletes the binding: true");
	is(sql($db, "SELECT idempotency.unbind_scope('regress_binder')"), 'f',
		"$db: a second time: false");
	is(sql($db, "SELECT idempotency.unbind_scope(NULL) IS NULL"), 't',
		"$db: unbind_scope(NULL) is NULL (STRICT)");
	is(sql($db, "SELECT idempotency.unbind_scope('regress_plain')"), 't',
		"$db: a binding made before the update is deleted: true");
	is(sql($db, "SELECT idempotency.unbind_scope('regress_plain')"), 'f',
		"$db: a second time: false");

	# regress_binder, granted EXECUTE before the update, unbinds the tenant.
	is(sql($db, "SET ROLE regress_binder; SELECT idempotency.unbind_scope('regress_tenant')"),
		't', "$db: regress_binder unbinds the tenant: true");
	is(sql($db, "SET ROLE regress_binder; SELECT idempotency.unbind_scope('regress_tenant')"),
		'f', "$db: a second time: false");
	is( sqlstate_of($node, $db,
			"SET ROLE regress_plain; SELECT idempotency.unbind_scope('regress_tenant')"),
		'42501', "$db: a role without the grant may not call unbind_scope");
	is(sql($db, $binding_rows_sql), '', "$db: no binding is left");
	is( claim($node, $db, q{'t2', scope => 'other'}, role => 'regress_tenant')->{outcome},
		'claimed', "$db: the unbound tenant claims in another scope");

	# --- distribute() without Citus ----------------------------------------
	$rows     = key_rows($node, $db);
	$bindings = sql($db, $binding_rows_sql);
	$seq      = sql($db, $seq_sql);
	foreach my $arg ('', '4', '0', '-1', 'NULL')
	{
		my ($state, $out, $err) =
		  sql_result($node, $db, "SELECT idempotency.distribute($arg)");
		is($state, '55000', "$db: distribute($arg) without Citus raises 55000");
		like($err, qr/extension "citus" is not installed in this database/,
			"$db: distribute($arg) says Citus is missing");
	}
	is( sqlstate_of($node, $db, 'SET ROLE regress_plain; SELECT idempotency.distribute()'),
		'42501', "$db: a role with USAGE on the schema may not call distribute()");
	is(key_rows($node, $db), $rows, "$db: distribute() changed no key");
	is(sql($db, $binding_rows_sql), $bindings, "$db: nor a binding");
	is(sql($db, $seq_sql), $seq, "$db: nor the token sequence");
	is( sql($db,
			    "SELECT concat_ws(',', to_regclass('pg_catalog.pg_dist_partition'), "
			  . "(SELECT count(*) FROM pg_extension WHERE extname = 'citus'))"),
		'0', "$db: no Citus catalog and no citus extension appeared");

	# --- cluster_stats -------------------------------------------------------
	is(sql($db, $cluster_stats_sql), '1|local|t|t',
		"$db: cluster_stats: one row, node local, this database's stats row");
	is(sql($db, "SET ROLE regress_plain; $cluster_stats_sql"), '1|local|t|t',
		"$db: a plain role reads the same");

	# --- the catalog ---------------------------------------------------------
	# The administrator's grants are on unbind_scope and scope_bindings:
	# everything but the functions' and relations' privileges is fresh 1.5's.
	foreach my $what ('claim_result columns', 'types (owner, privileges)', 'indexes',
		'constraints', 'triggers', 'the stats view', 'the token sequence',
		'extension members', 'extension configuration', 'initial privileges',
		'function definitions', 'view definitions')
	{
		my $q =
			$what eq 'function definitions' ? $function_defs_sql
		  : $what eq 'view definitions'     ? $view_defs_sql
		  :                                   $catalog{$what};
		is(sql($db, $q), $fresh{$what}, "$db updated = fresh: $what");
	}

	# --- the roles can go once their grants are revoked ----------------------
	sql($db, qq{
REVOKE EXECUTE ON FUNCTION $unbind_sig FROM regress_binder;
REVOKE SELECT, DELETE ON idempotency.scope_bindings FROM regress_binder;
REVOKE USAGE ON SCHEMA idempotency FROM $roles;
});
	is(sql($db, $catalog{'functions (definition, owner, privileges)'}),
		$fresh{'functions (definition, owner, privileges)'},
		"$db: with the grant revoked, every function's owner and privileges are fresh 1.5's");
}
my ($state, $out, $err) = sql_result($node, 'postgres', "DROP ROLE $roles");
is($state, '00000', 'with their grants revoked and bindings deleted, the roles can be dropped')
  or diag($err);

# =========================================================================
# Without an administrator's privileges, the whole catalog is fresh 1.5's
# =========================================================================
foreach my $from (@from)
{
	(my $db = "cat_$from") =~ s/\./_/;
	sql('postgres', "CREATE DATABASE $db");
	sql($db, "CREATE EXTENSION idempotency VERSION '$from'");
	is(sqlstate_of($node, $db, "ALTER EXTENSION idempotency UPDATE TO '1.5'"), '00000',
		"$db: updated from $from");
	is(ext_version($db), '1.5', "$db: 1.5");
	foreach my $what (sort keys %catalog)
	{
		is(sql($db, $catalog{$what}), $fresh{$what}, "$db updated = fresh: $what");
	}
	is(sql($db, $view_defs_sql), $fresh{'view definitions'},
		"$db updated = fresh: view definitions");
}

$node->stop;
done_testing();
